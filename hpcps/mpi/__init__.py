"""The door to MPI: the grid of ranks (topology), message tags and headers (protocol), timed
waits and collectives (comm). Layers above speak through these modules."""
