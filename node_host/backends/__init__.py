"""Worker backends. Every backend speaks the worker protocol (DESIGN.md section 3)."""
