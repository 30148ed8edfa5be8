#!/bin/sh
# Open MPI's "remote shell" for the emulated testbed: mpirun (in the switch namespace)
# calls "mpi_rsh_agent.sh HOST_ADDRESS COMMAND"; this runs COMMAND (an orted) inside the
# host's namespace, with its own host name so that ORTE tells the hosts apart.
# Host 10.213.0.N is namespace tfo-h(N-1) (see tfoverlap/testbed/network.py).
host="$1"; shift
index=$(( ${host##*.} - 1 ))
exec ip netns exec "tfo-h$index" unshare --uts sh -c "hostname tfo-h$index; exec $*"
