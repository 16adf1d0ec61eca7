"""contextkit."""
