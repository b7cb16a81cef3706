"""The result store: one SQLite file shared by every command and worker."""
