"""What differs per API (TF1 optimizers, tape loops, Keras ``fit``): where the gradients
are intercepted, where the plan gets its graph, and where pending work is drained."""
