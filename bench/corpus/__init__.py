"""The parts of ``bench/build_corpus.py`` (its docstring describes the corpus, its sources and
commands): ``documents`` (cleaning, hashing, grouping, thinning), one module per kind of source
(``dictionaries``, ``html_docs``, ``manuals``), ``sources`` (the priority list), ``pack`` (the size
budget and the xz files), ``code`` (which Python files make code documents) and ``inputs`` (the
build command's data_prep inputs, tokenization and mix tables)."""
