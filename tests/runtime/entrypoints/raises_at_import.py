"""A user module that fails while it is imported."""

raise RuntimeError("the data bucket is not mounted")
