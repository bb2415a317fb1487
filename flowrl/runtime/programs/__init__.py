"""Node programs: what an executor runs for one node per step, and the table that builds them."""
