"""Input and results: records in, rows checked, items admitted; run directories, sinks and readers."""
