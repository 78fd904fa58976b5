"""Hostile inputs, one file per surface (issue 30): what a careful user expects of each."""
