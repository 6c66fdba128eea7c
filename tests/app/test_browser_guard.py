"""A machine without chromium or Playwright fails the real-browser tests; it never skips them
(issue 10, item 16: a skipped browser test is not a pass)."""

from __future__ import annotations

import pytest
import test_browser


def test_missing_chromium_fails_the_browser_tests_instead_of_skipping(monkeypatch, tmp_path):
    monkeypatch.setattr(test_browser, "CHROMIUM", str(tmp_path / "no-chromium"))
    with pytest.raises(pytest.fail.Exception, match="browser tests need chromium"):
        test_browser._need_browser()


def test_missing_playwright_fails_the_browser_tests_instead_of_skipping(monkeypatch):
    monkeypatch.setattr(test_browser, "_has_playwright", lambda: False)
    with pytest.raises(pytest.fail.Exception, match="playwright"):
        test_browser._need_browser()
