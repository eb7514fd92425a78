"""Decode service: the public Generation API; generates tokens from transferred or local KV."""
