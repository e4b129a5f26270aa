"""What crosses between the core and its shells: the records (``records``) and, between
processes, their frames (``framing``). Imports nothing of the frontend above it."""
