"""HTTP pieces both front ends use (a rank's server and the router), kept free of either:
nothing here imports the engine, the server or the router."""
