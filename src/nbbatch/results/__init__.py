"""Results: reading a share back — status tables and logs, comparisons and reports, diffs, checks."""
