"""The sink's helpers on the engine side: the calls it sent, and the markers it spills and forwards."""

__all__: list[str] = []
