"""Pure stage functions, one module per family (DESIGN.md section 3)."""
