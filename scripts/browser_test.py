#!/usr/bin/env python3
"""Checks HTML reports in a real headless Chromium (selenium + Debian's chromium-driver).

    scripts/browser_test.py OUT_DIR REPORT.json REPORT.html [REPORT.json REPORT.html ...]

For each report: no console error while loading or clicking; one heatmap per path with one
cell per (layer group, position); the first-divergence marker where the JSON says; a real click
on it shows that tap's numbers; a screenshot in OUT_DIR. Exits 1 on the first failure.
"""
import json
import os
import sys
import tempfile

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = os.environ.get("KVDIFF_CHROMIUM", "/usr/bin/chromium")
DRIVER = os.environ.get("KVDIFF_CHROMEDRIVER", "/usr/bin/chromedriver")


def browser(profile):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
              "--no-first-run", "--disable-background-networking", "--disable-component-update",
              "--disable-sync", "--window-size=1400,1000", f"--user-data-dir={profile}"]:
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(DRIVER), options=opts)


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def console_errors(drv, where):
    errors = [l for l in drv.get_log("browser") if l["level"] == "SEVERE"]
    if errors:
        fail(f"{where}: console errors: {errors}")


def check(drv, json_path, html_path, shot):
    report = json.load(open(json_path))
    drv.get("file://" + os.path.abspath(html_path))
    WebDriverWait(drv, 20).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    console_errors(drv, html_path)
    if "worst" in report:  # a sweep summary: one row per path and per worst case
        rows = len(drv.find_elements(By.CSS_SELECTOR, "#paths tbody tr"))
        worst = len(drv.find_elements(By.CSS_SELECTOR, "#worst tbody tr"))
        if (rows, worst) != (len(report["paths"]), len(report["worst"])):
            fail(f"{html_path}: {rows} path rows and {worst} worst cases, JSON {len(report['paths'])} and {len(report['worst'])}")
        drv.save_screenshot(shot)
        print(f"ok: {html_path}: {rows} paths, {worst} worst cases, screenshot {shot}")
        return
    if "rows" in report:  # an eval page: one table row per path
        got = len(drv.find_elements(By.CSS_SELECTOR, "#scores tbody tr"))
        if got != len(report["rows"]):
            fail(f"{html_path}: {got} rows for {len(report['rows'])} paths")
        drv.save_screenshot(shot)
        print(f"ok: {html_path}: {got} eval rows, screenshot {shot}")
        return
    canvases = drv.find_elements(By.CSS_SELECTOR, "canvas.heat")
    paths = report["paths"]
    if len(canvases) != len(paths):
        fail(f"{html_path}: {len(canvases)} heatmaps for {len(paths)} paths")
    clicked = 0
    for i, (canvas, p) in enumerate(zip(canvases, paths)):
        g = p["grid"]
        want = len(g["groups"]) * g["positions"]
        got = int(canvas.get_attribute("data-cells"))
        if got != want or int(canvas.get_attribute("data-groups")) != len(g["groups"]):
            fail(f"{p['path']}: {got} cells drawn, the JSON has {want}")
        cw, ch, left = (int(canvas.get_attribute(a)) for a in ("data-cell-w", "data-cell-h", "data-left"))
        if canvas.size["width"] != left + cw * g["positions"] or canvas.size["height"] != ch * len(g["groups"]):
            fail(f"{p['path']}: canvas {canvas.size} does not hold one cell per (layer, position)")
        d = p["first_divergence"]
        markers = drv.find_elements(By.CSS_SELECTOR, f'.first-div[data-path="{i}"]')
        if d is None:
            if markers:
                fail(f"{p['path']}: a first-divergence marker but no divergence in the JSON")
            continue
        if len(markers) != 1:
            fail(f"{p['path']}: {len(markers)} first-divergence markers")
        m = markers[0]
        group = d["tap"] if d["layer"] is None else f"L{d['layer']}"
        if (m.get_attribute("data-tap"), int(m.get_attribute("data-position")), m.get_attribute("data-group")) != (d["tap"], d["position"], group):
            fail(f"{p['path']}: marker at {m.get_attribute('data-tap')}/{m.get_attribute('data-position')}, JSON says {d['tap']}/{d['position']}")
        # The marker sits on its cell: left and top match the cell's.
        ml, mt = m.location["x"] - canvas.location["x"] + 2, m.location["y"] - canvas.location["y"] + 2
        gi = g["groups"].index(group)
        if (round(ml), round(mt)) != (left + d["position"] * cw, gi * ch):
            fail(f"{p['path']}: marker at ({ml}, {mt}), cell at ({left + d['position'] * cw}, {gi * ch})")
        drv.execute_script("arguments[0].scrollIntoView({block: 'center', inline: 'center'});", m)
        ActionChains(drv).move_to_element(m).click().perform()
        details = drv.find_element(By.ID, "details")
        tap = drv.find_element(By.ID, "d-tap").text
        max_abs = float(drv.find_element(By.ID, "d-maxabs").text)
        if tap != d["tap"] or details.get_attribute("data-position") != str(d["position"]):
            fail(f"{p['path']}: click shows {tap} at {details.get_attribute('data-position')}")
        if abs(max_abs - d["max_abs"]) > 1e-3 * abs(d["max_abs"]) + 1e-12:
            fail(f"{p['path']}: click shows max|diff| {max_abs}, JSON {d['max_abs']}")
        if d.get("test") and drv.find_element(By.ID, "d-test").text != d["test"]:
            fail(f"{p['path']}: click shows test {drv.find_element(By.ID, 'd-test').text}, JSON {d['test']}")
        if d.get("systematic") and not drv.find_element(By.ID, "d-systematic").text.startswith(d["systematic"]["op"]):
            fail(f"{p['path']}: click shows systematic {drv.find_element(By.ID, 'd-systematic').text!r}, JSON {d['systematic']}")
        if d.get("blame") and not drv.find_element(By.ID, "d-replay").text.startswith(d["blame"]["op"]):
            fail(f"{p['path']}: click shows replay {drv.find_element(By.ID, 'd-replay').text!r}, JSON {d['blame']}")
        clicked += 1
    console_errors(drv, html_path + " after clicks")
    # The screenshot shows the first path that parts, its first divergence clicked.
    first = drv.find_elements(By.CSS_SELECTOR, ".first-div")
    if first:
        ActionChains(drv).move_to_element(first[0]).click().perform()
        drv.execute_script("arguments[0].closest('section').scrollIntoView({block: 'start'});", first[0])
    else:
        drv.execute_script("window.scrollTo(0, 0)")
    drv.save_screenshot(shot)
    print(f"ok: {html_path}: {len(paths)} heatmaps, {clicked} first divergences clicked, screenshot {shot}")


def main():
    out, files = sys.argv[1], sys.argv[2:]
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        drv = browser(profile)
        try:
            for j, h in zip(files[::2], files[1::2]):
                name = os.path.splitext(os.path.basename(h))[0]
                check(drv, j, h, os.path.join(out, f"{name}.png"))
        finally:
            drv.quit()


if __name__ == "__main__":
    main()
