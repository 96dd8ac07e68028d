"""What a journal can hold, without the journal: the modules that check a request against it (a node's API, its
engines) import this, not SQLAlchemy."""

# The largest bootstrap room a journal can hold: SQLite's INTEGER is signed 64-bit. SGLang's router draws rooms below
# 2**63 too, so every room a real router sends fits; anything larger is refused before a room is created.
MAX_ROOM = 2**63 - 1
