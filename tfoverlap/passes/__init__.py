"""The passes: each a function from a GraphDef (plus a context) to a new GraphDef and a
report, run, verified and rolled back on failure by ``pipeline``."""
