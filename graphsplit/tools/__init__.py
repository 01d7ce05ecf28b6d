"""What sits on top of the library: the command line, step specs, and the split picture."""
