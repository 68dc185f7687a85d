"""A run's input: the Parquet reader of a dataset's shards, a stream dataset's reader, and
the tables of rows both hold.
"""
