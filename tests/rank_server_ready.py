"""Imported last by the rank server (harness.RANK_SERVER_PRELOAD), after torch and transformers.

``gc.freeze()`` moves every object the server holds into the permanent generation, which
the collector never scans: without it, the first full collection in each forked rank walks
all of torch's and transformers' objects, writing their headers and so copying every page
that holds one (copy-on-write), a pause of milliseconds landing anywhere in a test's timed
steps. A spawned rank, with objects of its own, pays neither.
"""

import gc

gc.freeze()
