"""Cluster process management: `kvstrata launch` (children on their ports, the supervisor
that restarts them, who owns a port), the flags and key files it hands its ranks, and a
rank's registration with routers."""
