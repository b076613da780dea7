"""Lab scripts behind some figures of docs/results.md; not part of the product (see README.md)."""
