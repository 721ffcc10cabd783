"""The node agent process."""
