"""The pure log: the events that change a rollout, its state, the rules that decide each event, and the
record, its canonical bytes and the input rules.

Nothing here reads a file, a clock or a random number; the files shell (``tokcap.files``) carries out
what the rules decide. Each module imports only the log and ``tokcap.errors``; the input rules ask
staging's row rules about a staged call's columns when they are called.
"""

__all__: list[str] = []
