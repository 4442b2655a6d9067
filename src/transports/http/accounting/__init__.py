"""What the server keeps and tells of the requests it served: usage stores (SQLite,
PostgreSQL), Prometheus metrics, the log, kept traces and the trace inspector."""
