"""Weight edges: which route each policy -> generator edge opens, and the halves that move the bytes."""
