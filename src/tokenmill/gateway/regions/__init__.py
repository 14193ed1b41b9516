"""Data residency and region preference: nearest first, cheapest for batch."""
