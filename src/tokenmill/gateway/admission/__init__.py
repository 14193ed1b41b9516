"""Priority classes, per-class slots and queues, and overload degradation."""
