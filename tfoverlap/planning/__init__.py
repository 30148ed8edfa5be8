"""Planning: from a GraphDef and options to a plan in plain data (the order of transfers,
the AllReduce buckets). The passes enforce these plans; the simulator and the CLI show them."""
