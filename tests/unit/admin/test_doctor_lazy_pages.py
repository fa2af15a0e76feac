"""gpusnap doctor's line on lazy pages: off by the setting, on where the kernel can, and what it
says (and how bad it is) where it cannot."""

from __future__ import annotations

import dataclasses

from gpusnap.admin.doctor import FAIL, OK, WARN, check_lazy_pages
from gpusnap.config import load_settings
from gpusnap.criu.lazy_pages import host_support


def test_auto_follows_the_kernel() -> None:
    auto = load_settings(env={})
    c = check_lazy_pages(auto)
    assert c.status == (OK if host_support()[0] else WARN)
    c = check_lazy_pages(auto, lambda: (False, "userfaultfd: Function not implemented"))
    assert c.status == WARN and "eager here: userfaultfd: Function not implemented" in c.detail


def test_asked_for_where_the_kernel_cannot_is_a_failure_with_its_fix() -> None:
    on = dataclasses.replace(load_settings(env={}), lazy_pages=True)
    c = check_lazy_pages(on, lambda: (False, "userfaultfd lacks EVENT_REMOVE"))
    assert c.status == FAIL and "lacks EVENT_REMOVE" in c.detail and "lazy_pages = auto" in c.fix


def test_off_is_off() -> None:
    off = dataclasses.replace(load_settings(env={}), lazy_pages=False)
    assert check_lazy_pages(off, lambda: (_ for _ in ()).throw(AssertionError("not asked"))).status == OK
