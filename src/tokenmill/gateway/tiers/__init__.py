"""Tiered routing: the `auto` alias, its classifier and the small-then-large cascade."""
