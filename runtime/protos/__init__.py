"""Protocol buffer messages the runtime sends between tasks (generated; see README.md)."""
