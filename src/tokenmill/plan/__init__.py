"""`tokenmill plan`: capacity planning (model.py: the model shape; planner.py: the formulas)."""
