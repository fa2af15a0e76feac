"""CRIU: locating CRIU >= 4.0 (:mod:`.locate`), per-container config files (:mod:`.config`), reading its
image files (:mod:`.images`, :mod:`.pagemap`) and serving its lazy restore (:mod:`.lazy_pages`)."""
