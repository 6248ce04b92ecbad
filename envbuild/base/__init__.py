"""What every room stands on: the one user-facing error, the shipped data's location, reading and writing files safely, the grammars of generated values, parsing what others wrote, emulation."""
