"""The graph layer: a GraphDef as plain ids and lists, its transfers, and the checks every
rewritten graph must pass. Nothing above this layer reads GraphDef fields directly."""
