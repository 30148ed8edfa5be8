"""Where tfoverlap meets TensorFlow's runtime: the Grappler plugin, tf.function configs,
and rewrites of a graph that is still being built."""
