"""Paper reproduction write-ups, generated from saved JSON (see __main__ and papers)."""
