"""CRIU: locating CRIU >= 4.0 (:mod:`.locate`) and per-container config files (:mod:`.config`)."""
