"""Paged attention behind one interface: :mod:`.backend` defines it, each other module implements it."""
