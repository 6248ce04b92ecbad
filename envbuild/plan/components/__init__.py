"""The components of a stack image, one module each (base.py: what each gives the plan)."""
