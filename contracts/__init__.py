"""Wire contracts of custody: the models, the canonical digest and the one codec.

This package imports nothing from ``workers``: a participant written against it (or
against the JSON Schemas and digest vectors it publishes) needs nothing else.
"""
