"""mpistrat."""
