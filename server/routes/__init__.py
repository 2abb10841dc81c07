"""One router module per API family."""
