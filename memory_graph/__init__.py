"""memory_graph."""
