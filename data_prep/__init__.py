"""Offline data preparation: text -> pre-tokenized webdataset shards + manifest.

Run ``python -m data_prep.tokenize --help``.
"""
