"""Pure stage functions, one module per family (docs/design.md section 3)."""
