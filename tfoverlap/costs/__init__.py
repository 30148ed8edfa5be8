"""The cost layer: profiles of real steps, traces, static FLOP estimates and the network
model that the schedulers plan with."""
