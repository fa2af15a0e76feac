"""The real runc: locating and running it (:mod:`.invoke`), reading its command line (:mod:`.argv`)."""
