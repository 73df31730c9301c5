// The conformance report page (conformance/html): builds everything from the JSON blob.
// Every string of the data is inserted as text (textContent / append), never as markup.
"use strict";
(() => {
  const D = JSON.parse(document.getElementById("report-data").textContent);
  // The blob keeps each repeated string once (D.texts), a step as a list of D.step_fields and
  // a cell's rerun command only where it is not D.rerun's pattern (data.py): unpacked here.
  const fill = (pattern, c) => pattern.split("{case}").join(D.cases[c.case])
    .split("{dtype}").join(D.dtypes[c.dtype]).split("{column}").join(D.columns[c.column].name);
  function unpackStep(row) {
    const step = {};
    D.step_fields.forEach((field, i) => {
      if (row[i] !== null && row[i] !== undefined) step[field] = row[i];
    });
    step.step = D.texts[step.step];
    step.passed = Boolean(step.passed);
    if (step.note !== undefined) step.note = D.texts[step.note];
    return step;
  }
  for (const c of D.cells) {
    c.steps = (c.steps || []).map(unpackStep);
    if (c.detail !== undefined) c.detail = D.texts[c.detail];
    if (c.rerun === undefined) c.rerun = fill(D.rerun, c);
  }
  const app = document.getElementById("app");
  const GLYPH = {
    "ok": "\u2713", "known": "K", "n/a": "\u2013", "unsupported": "u", "not provided": "\u00b7",
    "unexpected": "!", "FAIL": "\u2717", "error": "E", "timeout": "T",
  };
  const MEANING = {
    "ok": "passes the spec's tolerance (the number: worst error / tolerance)",
    "known": "a peer's known difference, verified against its alternative semantics",
    "n/a": "the column cannot express the case",
    "unsupported": "a feature the checked module declares unsupported",
    "not provided": "the module defines none of the cell's functions",
    "unexpected": "a peer that fails the spec and that no known difference explains",
    "FAIL": "fails the spec's tolerance", "error": "the implementation raised",
    "timeout": "a call did not return in time",
  };
  const SHORT = { float64: "64", float32: "32", bfloat16: "bf", float16: "16" };

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("data-") || key === "title" || key === "for") {
        node.setAttribute(key, String(value));
      } else node[key] = value;
    }
    for (const child of children) if (child !== null && child !== undefined) node.append(child);
    return node;
  }
  const statusClass = (s) => "st-" + s.replace(/[^A-Za-z]/g, "");
  const isNum = (x) => typeof x === "number";
  function fmt(x) {
    if (x === null || x === undefined) return "\u2013";
    if (!isNum(x)) return String(x);
    if (x === 0) return "0";
    const a = Math.abs(x);
    return a >= 1e5 || a < 1e-3 ? x.toExponential(3) : String(Number(x.toPrecision(6)));
  }
  function ratioText(r) {
    if (r === null || r === undefined) return "\u2013";
    if (!isNum(r)) return String(r);
    return r < 100 ? r.toFixed(2) : r.toExponential(0);
  }
  const cellName = (c) => `${D.columns[c.column].name} \u00b7 ${D.cases[c.case]} \u00b7 ` +
    D.dtypes[c.dtype];
  const failing = new Set(D.failing);

  // ---------------------------------------------------------------- header and summary
  document.title = `${D.ok ? "PASS" : "FAIL"} \u00b7 conformance report`;
  const banner = el("div", { class: "verdict " + (D.ok ? "pass" : "fail"), id: "banner" },
    el("span", { id: "verdict", text: D.summary }));
  if (!D.ok) banner.append(diagnosis());
  app.append(el("h1", { text: "Conformance report" }), banner);
  const counts = el("table", { class: "counts", id: "counts" });
  const statuses = D.statuses.filter((s) => D.cells.some((c) => c.status === s));
  counts.append(el("tr", {}, el("th", { text: "column" }), el("th", { text: "key" }),
    el("th", { text: "kind" }), ...statuses.map((s) => el("th", {}, swatch(s), s)),
    el("th", { text: "failing" })));
  for (const col of D.columns) {
    const n = (s) => col.counts[s] || 0;
    counts.append(el("tr", {}, el("td", { class: "mono", text: col.name }),
      el("td", { class: "mono", text: col.key }), el("td", { text: col.kind }),
      ...statuses.map((s) => el("td", { text: String(n(s)) })),
      el("td", { text: String(D.failing.reduce((t, s) => t + n(s), 0)) })));
  }
  app.append(el("h2", { text: "Summary" }), counts);

  // The failing run's diagnosis: each group of failing backend cells (one bug, one group, as
  // the terminal report groups them) with its rerun command, then the failing bad inputs and
  // property checks.
  function diagnosis() {
    const list = el("ol", { id: "diagnosis" });
    D.reproducers.forEach((g, i) => {
      const item = el("li", { "data-group": i }, el("b", { class: "name", text: g.diagnosis }),
        ` \u2014 ${g.column}, ${g.status}: ${g.cases} case(s), ${g.cells} cell(s) `,
        el("button", { type: "button", class: "show", "data-group": i, text: "show" }));
      if (g.reason !== g.diagnosis) item.append(el("div", { class: "reason", text: g.reason }));
      item.append(el("div", { class: "rerun" }, "rerun: ", el("code", { text: g.rerun })));
      list.append(item);
    });
    if (D.verdict.bad_inputs) {
      list.append(el("li", {}, el("b", { class: "name", text: D.verdict.bad_inputs }),
        " \u2014 the section Bad inputs below lists them"));
    }
    if (D.verdict.properties.length) {
      list.append(el("li", {}, el("b", { class: "name", text: "property checks fail" }),
        ` on ${D.verdict.properties.join(", ")} \u2014 the section Property checks below ` +
        "gives the reproducer"));
    }
    list.addEventListener("click", (e) => {
      const button = e.target.closest("button.show");
      if (button) showGroup(Number(button.dataset.group));
    });
    return el("div", { class: "diagnosis" }, el("p", { class: "lead", text: "Diagnosis, one " +
      "bug per group, as the terminal report groups the failing cells:" }), list);
  }
  function showGroup(i) {  // the cell each group's smallest case was shrunk from
    const g = D.reproducers[i];
    const from = (c) => D.cases[c.case] === g.from_case && D.dtypes[c.dtype] === g.from_dtype;
    const k = D.cells.findIndex((c) => c.group === i && from(c));
    const index = k >= 0 ? k : D.cells.findIndex((c) => c.group === i);
    const td = grid.querySelector(`td.cell[data-index="${index}"]`);
    td.scrollIntoView({ block: "center", inline: "nearest" });
    show(index, td);
    td.focus({ preventScroll: true });
  }

  function swatch(status) {
    return el("span", { class: "swatch " + statusClass(status), text: GLYPH[status] || "?",
      title: MEANING[status] || status });
  }

  // ---------------------------------------------------------------- filters
  const filters = el("form", { class: "filters", id: "filters" });
  filters.addEventListener("submit", (e) => e.preventDefault());
  function group(name, title, items) {
    const box = el("fieldset", { "data-filter": name }, el("legend", { text: title }));
    items.forEach(([value, label, extra]) => {
      const input = el("input", { type: "checkbox", checked: true, value: String(value),
        "data-filter": name });
      box.append(el("label", {}, input, extra || null, label));
    });
    return box;
  }
  filters.append(
    group("column", "columns", D.columns.map((c, i) => [i, c.name])),
    group("dtype", "dtypes", D.dtypes.map((d, i) => [i, d])),
    group("status", "status", statuses.map((s) => [s, `${s} (${
      D.cells.filter((c) => c.status === s).length})`, swatch(s)])));
  const caseFilter = el("input", { type: "search", id: "case-filter",
    placeholder: "filter cases by name" });
  const shown = el("span", { id: "shown" });
  const onlyFailing = el("button", { type: "button", id: "only-failing", text: "only failing" });
  const reset = el("button", { type: "button", id: "reset", text: "show all" });
  filters.append(el("fieldset", {}, el("legend", { text: "case" }), caseFilter),
    el("fieldset", {}, el("legend", { text: "cells" }), onlyFailing, reset, shown));
  app.append(el("h2", { text: "Matrix" }), filters);

  // ---------------------------------------------------------------- grid
  // A column's header is its key (the terminal report's); its full name is the header's
  // tooltip and in the key list under the grid, so every column fits a 1,400 px screen.
  const grid = el("table", { id: "grid" });
  // a dtype's cell: 1,000 px / (columns x dtypes), from 13 px (18 columns of 4) to 24 px
  const size = Math.floor(1000 / Math.max(D.columns.length * D.dtypes.length, 1));
  grid.style.setProperty("--cell", `${Math.max(13, Math.min(24, size))}px`);
  const head1 = el("tr", {}, el("th", { class: "case-h", rowSpan: 2, text: "case" }));
  const head2 = el("tr");
  D.columns.forEach((col, i) => {
    head1.append(el("th", { class: "colhead first" + (col.kind === "peer" ? " peer" : ""),
      colSpan: D.dtypes.length, "data-column": i, title: `${col.name} (${col.kind})`,
      text: col.key }));
    D.dtypes.forEach((d, j) => head2.append(el("th", { class: "dt" + (j === 0 ? " first" : ""),
      "data-column": i, "data-dtype": j, title: d, text: SHORT[d] || d })));
  });
  grid.append(el("thead", {}, head1, head2));
  const at = new Map(D.cells.map((c, k) => [`${c.case}/${c.column}/${c.dtype}`, k]));
  const body = el("tbody");
  D.cases.forEach((name, r) => {
    const row = el("tr", { "data-case": r }, el("th", { class: "case-name", text: name }));
    D.columns.forEach((col, i) => D.dtypes.forEach((d, j) => {
      const k = at.get(`${r}/${i}/${j}`);
      const td = el("td", { class: j === 0 ? "first" : "", "data-column": i, "data-dtype": j });
      if (k !== undefined) {
        const c = D.cells[k];
        td.classList.add("cell", statusClass(c.status));
        if (c.status === "ok" && isNum(c.ratio) && c.ratio > 0.5) td.classList.add("hi");
        td.dataset.index = k;
        td.dataset.status = c.status;
        td.tabIndex = 0;
        td.title = `${cellName(c)}: ${c.status} ${ratioText(c.ratio)}`;
        td.textContent = GLYPH[c.status] || "?";
      }
      row.append(td);
    }));
    body.append(row);
  });
  grid.append(body);
  const hint = el("p", { class: "muted", id: "hint", text: "One cell per dtype (" +
    D.dtypes.map((d) => `${SHORT[d] || d} ${d}`).join(", ") + ") in each column. Click a " +
    "cell (or focus it and press Enter) to see its steps against the tolerance, its known " +
    "difference or its smallest failing case in the panel at the bottom (Esc closes it)." });
  const keys = el("p", { class: "keys", id: "column-keys" }, el("span", { class: "muted",
    text: "columns: " }), ...D.columns.map((col, i) => el("span", { class: "key",
    "data-column": i }, el("b", { class: "mono", text: col.key }), ` ${col.name}`)));
  const detail = el("aside", { id: "detail", hidden: true });
  app.append(hint, el("div", { class: "grid-wrap" }, grid), keys, detail);

  function checked(name) {
    return new Set([...filters.querySelectorAll(`input[data-filter="${name}"]`)]
      .filter((x) => x.checked).map((x) => x.value));
  }
  function apply() {
    const cols = checked("column"), dts = checked("dtype"), sts = checked("status");
    const text = caseFilter.value.trim().toLowerCase();
    let visible = 0;
    grid.querySelectorAll("thead th[data-dtype]").forEach((th) => th.classList.toggle("gone",
      !cols.has(th.dataset.column) || !dts.has(th.dataset.dtype)));
    grid.querySelectorAll("thead th.colhead").forEach((th) => {
      th.classList.toggle("gone", !cols.has(th.dataset.column) || dts.size === 0);
      th.colSpan = Math.max(dts.size, 1);
    });
    for (const row of body.rows) {
      const match = D.cases[row.dataset.case].toLowerCase().includes(text);
      let any = false;
      for (const td of row.querySelectorAll("td")) {
        td.classList.toggle("gone", !cols.has(td.dataset.column) || !dts.has(td.dataset.dtype));
        if (td.dataset.index === undefined) continue;
        td.classList.toggle("off", !sts.has(td.dataset.status));
        if (match && !td.classList.contains("gone") && !td.classList.contains("off")) {
          any = true;
          visible += 1;
        }
      }
      row.classList.toggle("gone", !any);
    }
    shown.textContent = `${visible} of ${D.cells.length} cells shown`;
  }
  filters.addEventListener("change", apply);
  caseFilter.addEventListener("input", apply);
  onlyFailing.addEventListener("click", () => {
    filters.querySelectorAll('input[data-filter="status"]').forEach((x) => {
      x.checked = failing.has(x.value);
    });
    apply();
  });
  reset.addEventListener("click", () => {
    filters.querySelectorAll("input[type=checkbox]").forEach((x) => { x.checked = true; });
    caseFilter.value = "";
    apply();
  });
  apply();

  // ---------------------------------------------------------------- one cell's detail
  function stepsTable(c) {
    const table = el("table", { class: "steps" }, el("tr", {}, ...["step", "ratio", "where",
      "actual", "expected (float64)", "bound"].map((h) => el("th", { text: h }))));
    // a known cell's steps over the tolerance are what its known difference explains: shaded
    // as known, not as failed
    const overClass = c.status === "known" ? "known" : "failed";
    for (const s of c.steps) {
      const over = !s.passed;
      const bar = el("span", { class: "bar" + (over ? ` over ${overClass}` : "") }, el("span"));
      bar.firstChild.style.width = `${isNum(s.ratio) ? Math.min(s.ratio, 1) * 100 : 100}%`;
      const why = s.error ? `raised ${s.error}` : s.note;
      table.append(el("tr", { class: (why ? "step" : "") + (over ? ` ${overClass}` : "") },
        el("td", { class: "mono", text: s.step }),
        el("td", {}, s.error ? "raised" : ratioText(s.ratio), bar),
        el("td", { class: "mono", text: s.index ? `[${s.index.join(", ")}]` : "\u2013" }),
        el("td", { text: fmt(s.actual) }), el("td", { text: fmt(s.expected) }),
        el("td", { text: fmt(s.bound) })));
      if (why) {
        table.append(el("tr", { class: over ? overClass : "" }, el("td", { class: "note",
          colSpan: 6, text: `why: ${why}` })));
      }
    }
    return table;
  }
  function knownPart(c) {
    const col = D.columns[c.column].name;
    const entries = (D.known[col] || []).filter((e) => (c.alternatives || []).includes(e.short));
    const part = el("section", { class: "known" });
    if (c.status === "known") {
      part.append(el("h3", { text: "known difference, verified" }), el("p", {},
        "The peer matches the alternative semantics of ", el("b", { text: entries.map(
          (e) => e.short).join(" + ") }), " within the tolerance: distance ",
        el("b", { class: "distance", text: ratioText(c.distance) }),
        " (worst error / tolerance against the alternative; at most 1 matches)."));
    } else {
      part.append(el("h3", { text: "unexpected: no known difference explains it" }),
        el("p", {}, entries.length ? "Closest combination tried: " : "No entry of " +
          "spec.KNOWN_DIFFERENCES covers this cell.", entries.length ? el("b", {
          text: entries.map((e) => e.short).join(" + ") }) : null, entries.length ?
          ", distance " : null, entries.length ? el("b", { class: "distance",
          text: ratioText(c.distance) }) : null));
    }
    for (const e of entries) {
      part.append(el("div", { class: "entry" + (c.status === "known" ? "" : " unexpected") },
        el("h4", { text: e.short }), el("p", { class: "text", text: `differs: ${e.differs}` }),
        el("p", { class: "text alternative" }, "alternative: ", el("code", {
          text: e.alternative }), ` \u2014 ${e.meaning}`),
        el("p", { class: "text why", text: `why: ${e.why}` })));
    }
    return part;
  }
  function reproPart(c) {
    const g = D.reproducers[c.group];
    const part = el("section", { class: "reproducer" },
      el("h3", { text: "smallest failing case" }),
      el("p", { class: "text", text: `diagnosis: ${g.reason}` }));
    const where = `shrunk from ${g.from_case} \u00b7 ${g.from_dtype} (one of the ${g.cells} ` +
      `cell(s) of this group)`;
    if (g.code) {
      part.append(el("p", { class: "text", text: `${where}: step ${g.step}; ${g.shapes}; ` +
        g.dtype }), el("pre", { class: "code", text: g.code }));
    } else {
      part.append(el("p", { class: "text note", text: `${where}: ${g.note}` }));
    }
    return part;
  }
  function close() {
    detail.hidden = true;
    document.body.classList.remove("detail-open");
    const td = grid.querySelector("td.selected");
    if (td) {
      td.classList.remove("selected");
      td.focus({ preventScroll: true });
    }
  }
  function show(k, td) {
    const c = D.cells[k];
    grid.querySelectorAll("td.selected").forEach((x) => x.classList.remove("selected"));
    if (td) td.classList.add("selected");
    const shut = el("button", { type: "button", id: "detail-close", title: "close (Esc)",
      text: "\u00d7" });
    shut.addEventListener("click", close);
    const parts = [shut, el("h2", { text: cellName(c) }), el("p", {},
      el("span", { class: "status " + statusClass(c.status), text: c.status }),
      ` worst error / tolerance: ${ratioText(c.ratio)}` +
      (c.spec_backend ? "" : " (a peer: context, not counted)"))];
    // a FAIL cell's detail repeats its steps' notes: the steps table below shows them
    if (c.detail && c.status !== "FAIL") {
      parts.push(el("p", { class: "text detail", text: c.detail }));
    }
    if (c.reasons && c.reasons.length) {
      parts.push(el("ul", { class: "plain reasons" }, ...c.reasons.map((r) => el("li", {
        text: r }))));
    }
    if (c.features) parts.push(el("p", { class: "muted", text: "features: " +
      c.features.join(", ") }));
    if (c.skipped) parts.push(el("p", { class: "muted", text: "not run (not provided): " +
      c.skipped.join(", ") }));
    if (c.status === "known" || c.status === "unexpected") parts.push(knownPart(c));
    if (c.steps.length) parts.push(el("h3", { text: "steps against the tolerance" }),
      stepsTable(c));
    if (c.group !== undefined) parts.push(reproPart(c));
    else if (failing.has(c.status) && !c.spec_backend) {
      parts.push(el("p", { class: "muted", text: "A peer is context: no smallest case is " +
        "shrunk for it." }));
    }
    if (c.rerun) parts.push(el("h3", { text: "rerun" }), el("pre", { class: "rerun",
      text: c.rerun }));
    const pic = D.pictures.available && D.pictures.weights[D.cases[c.case]];
    if (pic) parts.push(el("h3", { text: "weights (float64 reference)" }),
      el("img", { class: "picture", src: pic, alt: `weights of ${D.cases[c.case]}` }));
    detail.replaceChildren(...parts);
    detail.hidden = false;
    detail.scrollTop = 0;
    document.body.classList.add("detail-open");
    if (td) keepInView(td);
  }
  // The selected cell stays in view above the panel: the grid moves to the top of the window
  // where the panel would cover the cell, and the grid's own scroll brings the cell in.
  function keepInView(td) {
    const wrap = td.closest(".grid-wrap");
    if (td.getBoundingClientRect().bottom > detail.getBoundingClientRect().top) {
      window.scrollBy(0, wrap.getBoundingClientRect().top - 4);
    }
    const cell = td.getBoundingClientRect(), box = wrap.getBoundingClientRect();
    const head = grid.tHead.getBoundingClientRect().height;
    if (cell.bottom > box.bottom) wrap.scrollTop += cell.bottom - box.bottom + 2;
    else if (cell.top < box.top + head) wrap.scrollTop -= box.top + head - cell.top + 2;
  }
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && !detail.hidden) close();
  });
  body.addEventListener("click", (e) => {
    const td = e.target.closest("td.cell");
    if (td) show(Number(td.dataset.index), td);
  });
  body.addEventListener("keydown", (e) => {
    const td = e.target.closest("td.cell");
    if (td && (e.key === "Enter" || e.key === " ")) {
      e.preventDefault();
      show(Number(td.dataset.index), td);
    }
  });

  // ---------------------------------------------------------------- the rest of the run
  const legend = el("details", { id: "legend" }, el("summary", { text: "legend" }),
    el("ul", { class: "plain" }, ...D.statuses.map((s) => el("li", {}, swatch(s),
      `${s}: ${MEANING[s]}`))), el("p", { class: "text muted", text: D.legend }));
  app.append(legend);
  const knownList = el("section", { id: "known" }, el("h2", { text: "Known differences met" }));
  const peers = Object.keys(D.known);
  if (!peers.length) knownList.append(el("p", { class: "muted", text: "none in this run" }));
  for (const peer of peers) {
    for (const e of D.known[peer]) {
      knownList.append(el("div", { class: "entry" }, el("h4", { text: `${peer}: ${e.short}` }),
        el("p", { class: "text", text: `differs: ${e.differs}` }),
        el("p", { class: "text" }, "alternative: ", el("code", { text: e.alternative }),
          ` \u2014 ${e.meaning}`), el("p", { class: "text", text: `why: ${e.why}` })));
    }
  }
  app.append(knownList);
  const bad = el("section", { id: "bad-inputs" }, el("h2", { text: "Bad inputs" }),
    el("p", { text: `${D.errors.passed}/${D.errors.total} bad inputs raise the spec's error` }));
  for (const e of D.errors.failing) {
    bad.append(el("p", { class: "text", text: `${e.spec_backend ? "FAIL" : "peer"} ` +
      `${e.backend} \u00b7 ${e.case}: ${e.problem}` + (e.message ? ` (message: ${e.message})`
      : "") }));
  }
  if (D.errors.total) app.append(bad);
  if (D.properties) {
    const props = el("section", { id: "properties" }, el("h2", { text: "Property checks" }),
      el("p", { text: D.properties.summary }));
    for (const b of D.properties.backends) {
      props.append(el("p", { class: "text", text: b.line }));
      if (b.failure) props.append(el("p", { class: "text", text: b.failure }),
        el("pre", { class: "code", text: b.reproducer }));
    }
    app.append(props);
  }
  const missing = Object.entries(D.missing);
  if (missing.length || D.notes.length) {
    app.append(el("h2", { text: "Not run" }), el("ul", { class: "plain", id: "missing" },
      ...missing.map(([name, how]) => el("li", { text: `missing: ${name} (install: ${how})` })),
      ...D.notes.map((n) => el("li", { text: n }))));
  }
  const pics = el("section", { id: "pictures" }, el("h2", { text: "Pictures" }));
  if (!D.pictures.available) {
    pics.append(el("p", { class: "muted", id: "no-pictures", text: D.pictures.note }));
  } else {
    const gallery = el("div", { class: "gallery" });
    for (const [name, uri] of [...Object.entries(D.pictures.errors),
      ...Object.entries(D.pictures.other)]) {
      gallery.append(el("figure", {}, el("img", { class: "picture", src: uri,
        alt: `error vs tolerance: ${name}` }), el("figcaption", { text: name })));
    }
    pics.append(el("p", { class: "muted", text: "Worst error / tolerance per step and dtype " +
      "(1 = the tolerance); each case's weights heatmap is in its cells' detail." }), gallery);
  }
  app.append(pics);

  // ---------------------------------------------------------------- the article's example
  // The seed article's 6 tokens (float64 reference): each weight's numbers on hover or focus.
  const A = D.article;
  const num = (x) => (x === "-inf" ? "\u2212inf (masked)" : String(x));
  const tip = el("p", { id: "article-tip", class: "mono", text: "Point at a weight (or focus " +
    "it) to see how it came to be: \u03c9 = q\u00b7k, then \u03c9/\u221ad_k, then the softmax." });
  function tipText(part, i, j) {
    const p = A[part];
    return `${p.title} \u00b7 query ${i + 1} '${A.tokens[i]}' \u2192 key ${j + 1} ` +
      `'${A.tokens[j]}': \u03c9 = q\u00b7k = ${num(p.scores[i][j])}; \u03c9/\u221a${A.d_k} = ` +
      `${num(p.scaled[i][j])}; weight = ${num(p.weights[i][j])}`;
  }
  function articleGrid(part) {
    const p = A[part];
    const top = Math.max(...p.weights.flat().filter(isNum), 1e-12);
    const table = el("table", { class: "article-grid", "data-part": part },
      el("caption", { text: p.title }), el("tr", {}, el("th", { text: "query \\ key" }),
        ...A.tokens.map((t) => el("th", { text: t }))));
    p.weights.forEach((row, i) => {
      const tr = el("tr", {}, el("th", { text: A.tokens[i] }));
      row.forEach((w, j) => {
        const masked = p.scaled[i][j] === "-inf";
        const td = el("td", { class: masked ? "masked" : "", tabIndex: 0, "data-row": i,
          "data-col": j, title: tipText(part, i, j), text: masked ? "" : Number(w).toFixed(2) });
        if (!masked) {
          td.style.backgroundColor = `rgba(63, 127, 214, ${(Number(w) / top).toFixed(3)})`;
          if (Number(w) > 0.55 * top) td.classList.add("dark");
        }
        tr.append(td);
      });
      table.append(tr);
    });
    return table;
  }
  const article = el("section", { id: "article" }, el("h2", { text: "The article's example, " +
    "step by step" }), el("p", { class: "muted", text: "The seed article's sentence " +
    "(docs/seed_article.md), computed in float64: each cell is one attention weight (white = " +
    "masked); point at it for its score \u03c9, its scaled score and its weight." }),
  el("div", { class: "article-grids" }, articleGrid("plain"), articleGrid("causal")), tip);
  const pointAt = (e) => {
    const td = e.target.closest("td[data-row]");
    if (td) tip.textContent = tipText(td.closest("table").dataset.part, +td.dataset.row,
      +td.dataset.col);
  };
  article.addEventListener("mouseover", pointAt);
  article.addEventListener("focusin", pointAt);
  app.append(article);
})();
