// closedloop monitor page: one WebSocket (/ws), rolling buffers, canvas charts. No dependencies.
"use strict";
(function () {
  const FLAG = { ACTED: 1, COMMAND: 2, SAFE: 4, DISCONNECTED: 8, WATCHDOG: 16 };
  const KEEP = 1500;           // steps kept for the charts
  const RASTER_ROWS = 200;     // input rows kept for the heat map
  const TEXT_CHARS = 1000;     // typed characters shown (the newest; a status update carries as many)
  const $ = (id) => document.getElementById(id);
  const S = window.monitorState = {
    info: null, connected: false, everConnected: false, ended: false, updates: 0, step: -1, state: "connecting", text: "",
    prompt: "", events: [], counts: { watchdog: 0, reconnects: 0, missed: 0, lost: 0, dropped: 0 },
    t: [], lat: [], late: [], missed: [], flags: [], cmd: [], inp: [], inpSeq: [], inpT: [], inpOut: [], inpSt: [], out: [], st: [], stepsSeen: 0, status: null,
    typedChars: 0,
  };
  let updatesThisSecond = 0;

  function push(arr, items, keep) { for (const x of items) arr.push(x); if (arr.length > keep) arr.splice(0, arr.length - keep); }

  function onHello(m) {
    S.info = m.info;
    const i = m.info;
    $("bundle").textContent = i.bundle_name || i.bundle || "-";  // a bundle exported without a name: its path
    $("family").textContent = i.family || "-";
    $("device").textContent = (i.device && (i.device.kind + " " + (i.device.name || ""))) || i.device_url || "-";
    $("backend").textContent = i.backend || "-";
    $("rate").textContent = i.rate_hz ? i.rate_hz + " Hz" : "-";
    const fam = i.family;
    const predicts = stateGroups().some((g) => g.name === "predicted");
    $("input-title").textContent = (fam === "bci" || fam === "bci_handwriting") ? "Input: neural channels (heat map, newest right)" :
      fam === "observer" ? (predicts ? "Input: plant measurements y, with the observer's prediction of each" :
                            "Input: plant measurements y, with the observer network's correction N(r)") :
      fam === "policy" ? "Input: task observation (hand position and velocity first)" : "Input";
    $("output-title").textContent = (fam === "bci" || fam === "bci_handwriting") ? "Output: decoded text" :
      fam === "observer" ? "Output: the command u = -K z_hat and the residual |r|" :
      fam === "policy" ? "Output: joint commands and episode outcomes" : "Output";
    $("text-box").hidden = !(fam === "bci" || fam === "bci_handwriting");
    $("state-panel").hidden = !stateGroups().some((g) => g.name !== "predicted");
    $("state-title").textContent = fam === "observer" ? "Estimate: the observer's state and disturbance estimate z_hat" :
      "Family state";
    if (i.mode === "recording") { $("scrub").hidden = false; $("recording-name").textContent = i.recording || ""; }
    for (const e of m.events || []) onEvent(e, true);
    renderEvents();
  }

  function onEvent(e, quiet) {
    if (e.event === "status") { onStatus(e); return; }
    if (e.event === "typed") {  // what a step typed, as it is typed (the next status carries the whole text)
      S.text = ((e.reset || e.chars < S.typedChars ? "" : (S.text || "")) + e.text).slice(-TEXT_CHARS);
      S.typedChars = e.chars;
      return;
    }
    if (e.event === "device_status" && e.code === 2) {  // a REPORT: what the device plays, e.g. the prompt
      try { const rep = JSON.parse(e.text); if (rep.source && rep.source.sentence) S.prompt = rep.source.sentence; /* kept while the writer rests */ } catch { /* not JSON */ }
      return;  // once a second: not an event a person needs listed
    }
    if (e.event === "session_info") {  // the device answered: its HELLO joins the session's info
      if (S.info) { Object.assign(S.info, e); const d = e.device; if (d) $("device").textContent = d.kind + " " + (d.name || ""); }
      return;
    }
    S.events.push(e);
    if (S.events.length > 300) S.events.splice(0, 100);
    if (e.event === "watchdog") S.counts.watchdog++;
    if (e.event === "reconnected") S.counts.reconnects++;
    if (e.event === "session_end") { S.ended = true; }
    if (!quiet) renderEvents();
  }

  function onStatus(e) {
    S.status = e;
    if (typeof e.text === "string") S.text = e.text;
    if (typeof e.chars === "number") S.typedChars = e.chars;
    if (typeof e.prompt === "string") S.prompt = e.prompt;
    if (e.state) S.state = e.state;
    if (e.lost !== undefined) S.counts.lost = e.lost;
    if (e.missed !== undefined) S.counts.missed = e.missed;
    if (e.watchdog_trips !== undefined) S.counts.watchdog = e.watchdog_trips;
    if (e.reconnects !== undefined) S.counts.reconnects = e.reconnects;
    const skip = new Set(["type", "event", "step", "state", "text", "prompt", "lost", "missed", "p99_us", "command_p99_us",
                          "watchdog_trips",
                          "reconnects", "t_ns"]);
    const parts = [];
    // counts as they are; a small value keeps 3 significant digits (an observer's |r| of 5e-6 is not 0)
    const num = (v) => (Number.isInteger(v) || Math.abs(v) >= 0.001 ? +v.toFixed(3) : +v.toPrecision(3));
    for (const [k, v] of Object.entries(e)) if (!skip.has(k)) parts.push(`${k} <b>${typeof v === "number" ? num(v) : v}</b>`);
    $("family-metrics").innerHTML = parts.join(" ");
    if (e.p99_us !== undefined) $("p99").textContent = Math.round(e.p99_us) + " us";
    if (typeof e.command_p99_us === "number") $("cmdp99").textContent = Math.round(e.command_p99_us) + " us";
  }

  // Rows arrive as base64 float32 ({f32, shape}); NaN marks "nothing this step".
  function rows(x) {
    if (!x || !x.f32) return x || [];
    const bin = atob(x.f32), bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    const all = new Float32Array(bytes.buffer), [n, w] = x.shape, out = [];
    for (let i = 0; i < n; i++) out.push(Array.from(all.subarray(i * w, (i + 1) * w)));
    return out;
  }

  // The family's state (info.state: one "GROUP/NAME" label per value, e.g. an observer's "state/x1",
  // "disturbance/d1", "predicted/y1") as groups: [{name, labels, offsets}] in label order, offsets into a state row.
  function stateGroups() {
    const groups = [];
    ((S.info && S.info.state) || []).forEach((label, k) => {
      const cut = label.indexOf("/"), name = cut < 0 ? "state" : label.slice(0, cut), short = cut < 0 ? label : label.slice(cut + 1);
      let g = groups.find((x) => x.name === name);
      if (!g) { g = { name, labels: [], offsets: [] }; groups.push(g); }
      g.labels.push(short); g.offsets.push(k);
    });
    return groups;
  }

  function onSteps(m) {
    m.inputs = rows(m.inputs); m.outputs = rows(m.outputs); m.command = rows(m.command); m.state = rows(m.state || []);
    S.updates++; updatesThisSecond++;
    S.counts.dropped += m.lost;
    S.stepsSeen += m.count;
    if (m.step.length) S.step = m.step[m.step.length - 1];
    push(S.t, m.t_s, KEEP); push(S.lat, m.latency_us, KEEP); push(S.late, m.lateness_us, KEEP);
    push(S.missed, m.missed, KEEP); push(S.flags, m.flags, KEEP); push(S.cmd, m.command, KEEP);
    push(S.out, m.outputs, KEEP);
    // the frames the loop acted on, and the outputs of those same steps (drawn beside an observer's input)
    const acted = m.flags.map((f, j) => j).filter((j) => m.flags[j] & FLAG.ACTED);
    push(S.inp, acted.map((j) => m.inputs[j]), RASTER_ROWS);
    push(S.inpSeq, acted.map((j) => m.input_seq[j]), RASTER_ROWS);
    push(S.inpT, acted.map((j) => m.t_s[j]), RASTER_ROWS);
    push(S.inpOut, acted.map((j) => m.outputs[j]), RASTER_ROWS);
    push(S.inpSt, acted.map((j) => m.state[j] || []), RASTER_ROWS);  // the family's state after reading each
    push(S.st, acted.map((j) => m.state[j] || []), KEEP);
    const last = m.flags[m.flags.length - 1] || 0;
    if (!S.status || !S.status.state) S.state = last & FLAG.DISCONNECTED ? "DISCONNECTED" : last & FLAG.SAFE ? "SAFE" : "running";
  }

  // --- a recording (closedloop monitor FILE): everything at once, the slider picks the moment shown ---------
  let REC = null;
  function upTo(ts, T) { let lo = 0, hi = ts.length; while (lo < hi) { const mid = (lo + hi) >> 1; if (ts[mid] <= T) lo = mid + 1; else hi = mid; } return lo; }

  function showAt(T) {
    const r = REC; if (!r) return;
    S.recordingT = T;
    $("slider-t").textContent = T.toFixed(2) + " s";
    const period = 1e6 / ((S.info && S.info.rate_hz) || 1);
    const n = upTo(r.steps.t_s, T), a = Math.max(0, n - KEEP);
    S.t = r.steps.t_s.slice(a, n); S.lat = r.steps.latency_us.slice(a, n); S.late = r.steps.lateness_us.slice(a, n);
    S.flags = r.steps.flags.slice(a, n);
    S.missed = S.lat.map((v, j) => (v + Math.max(S.late[j], 0) > period ? 1 : 0));
    S.step = n ? r.steps.step[n - 1] : -1;
    const last = S.flags[S.flags.length - 1] || 0;
    S.state = last & FLAG.DISCONNECTED ? "DISCONNECTED" : last & FLAG.SAFE ? "SAFE" : "running";
    const ni = upTo(r.inputs.t_s, T), i0 = Math.max(0, ni - RASTER_ROWS);
    S.inp = r.inputs.rows.slice(i0, ni);
    // each input frame's model run: the record of the same frame sequence number at or after the frame's time (a
    // frame the loop skipped for a newer one, or had not read yet at T, has none)
    const readBy = (series, i) => {
      const t = r.inputs.t_s[i], seq = r.inputs.seq[i], end = upTo(series.t_s, T);
      for (let k = upTo(series.t_s, t - 1e-4), n = 0; k < end && n < 64; k++, n++) if (series.seq[k] === seq) return series.rows[k];
      return null;
    };
    const shown = []; for (let i = i0; i < ni; i++) shown.push(i);
    S.inpSeq = shown.map((i) => r.inputs.seq[i]);
    S.inpT = shown.map((i) => r.inputs.t_s[i]);
    S.inpOut = shown.map((i) => readBy(r.outputs, i));
    const st = r.state || { t_s: [], rows: [], seq: [] }, ns = upTo(st.t_s, T);  // the family's state: the runs up
    S.st = st.rows.slice(Math.max(0, ns - KEEP), ns);                             // to T, and each frame's
    S.inpSt = shown.map((i) => readBy(st, i) || []);
    const series = r.commands.rows.length ? r.commands : r.outputs;
    const nc = upTo(series.t_s, T); S.cmd = series.rows.slice(Math.max(0, nc - KEEP), nc);
    const no = upTo(r.outputs.t_s, T); S.out = r.outputs.rows.slice(Math.max(0, no - KEEP), no);
    S.text = r.typed.filter((x) => x[0] <= T).map((x) => x[1]).join("");
    const upto = r.events.filter((e) => e.t_s <= T);
    const isReport = (e) => e.event === "device_status" && e.code === 2;
    S.events = upto.filter((e) => !isReport(e));
    const reports = upto.filter(isReport);
    S.prompt = "";
    for (const e of reports) { try { S.prompt = JSON.parse(e.text).source.sentence || S.prompt; } catch { /* not JSON */ } }
    S.counts.watchdog = S.events.filter((e) => e.event === "watchdog").length;
    S.counts.reconnects = S.events.filter((e) => e.event === "reconnected").length;
    // the session's own counts at T: every missed deadline since its start (not only the steps drawn), and the p99
    // of how long after its step began each of the last 2,048 commands went out, as the live status gives them
    const mt = r.steps.missed_total;
    S.counts.missed = mt && n ? mt[n - 1] : S.missed.reduce((x, y) => x + y, 0);
    const dl = (r.commands.delay_us || []).slice(Math.max(0, nc - 2048), nc).filter((d) => d !== null).sort((x, y) => x - y);
    $("cmdp99").textContent = dl.length ? Math.round(dl[Math.min(dl.length - 1, Math.floor(0.99 * dl.length))]) + " us" : "-";
    S.ended = T >= r.duration_s - 1e-6;  // the end of the file: the session's end (how, in the events)
    renderEvents();
    render();
  }

  function onRecording(m) {
    REC = m;
    // how it ended and what the file lacks, first in the events panel whatever the slider says
    const notes = (m.problems || []).map((text) => ({ event: "file_problem", step: null, t_s: -1, text }));
    notes.push({ event: "recording_end", step: null, t_s: -1,
                 stopped_by: m.stopped_by === null || m.stopped_by === undefined ? "no SUMMARY: the session did not end normally (killed, refused or cut short)" : m.stopped_by });
    m.events = notes.concat(m.events);
    S.status = { state: null };
    const sl = $("slider");
    sl.max = m.duration_s.toFixed(2); sl.value = sl.max;
    sl.oninput = () => showAt(parseFloat(sl.value));
    showAt(m.duration_s);
  }

  // --- drawing ----------------------------------------------------------------------------
  const COLORS = ["#58a6ff", "#f0883e", "#3fb950", "#bc8cff", "#ff7b72", "#d29922", "#39c5cf", "#e6e9ec"];

  function canvas(id) {
    const c = $(id), r = c.getBoundingClientRect(), dpr = window.devicePixelRatio || 1;
    const w = Math.max(50, Math.round(r.width * dpr)), h = Math.round(c.height > 0 ? (c.dataset.h || c.height) * dpr : 100);
    if (!c.dataset.h) c.dataset.h = c.height;
    if (c.width !== w || c.height !== h) { c.width = w; c.height = h; }
    const g = c.getContext("2d"); g.clearRect(0, 0, w, h); return [g, w, h];
  }

  function range(series) {
    let lo = Infinity, hi = -Infinity;
    for (const s of series) for (const v of s) if (v !== null && isFinite(v)) { if (v < lo) lo = v; if (v > hi) hi = v; }
    if (!isFinite(lo)) return [0, 1];
    if (hi - lo < 1e-9) { lo -= 1; hi += 1; }
    return [lo, hi];
  }

  // each column a line, colour k (+ first), dashed when dash is given
  function lines(g, w, h, cols, n, lo, hi, dash, first) {
    g.setLineDash(dash || []);
    cols.forEach((col, k) => {
      g.strokeStyle = COLORS[(k + (first || 0)) % COLORS.length]; g.lineWidth = 1.5; g.beginPath();
      let pen = false;
      col.forEach((v, i) => {
        if (v === null || !isFinite(v)) { pen = false; return; }
        const x = (i / Math.max(1, n - 1)) * w, y = h - ((v - lo) / (hi - lo)) * (h - 8) - 4;
        if (pen) g.lineTo(x, y); else g.moveTo(x, y); pen = true;
      });
      g.stroke();
    });
    g.setLineDash([]);
  }

  function column(rows, j) { return rows.map((r) => (r && j < r.length ? r[j] : null)); }

  function drawTiming() {
    const [g, w, h] = canvas("latency");
    const n = S.lat.length; if (!n) return;
    const [lo, hi] = range([S.lat, S.late]);
    S.missed.forEach((m, i) => { if (m) { g.fillStyle = "#f85149"; g.fillRect((i / Math.max(1, n - 1)) * w - 1, 0, 2, h); } });
    lines(g, w, h, [S.lat, S.late], n, Math.min(0, lo), hi);
    g.fillStyle = "#8a96a3"; g.font = `${12 * (window.devicePixelRatio || 1)}px sans-serif`;
    g.fillText(`${hi.toFixed(0)} us`, 4, 14 * (window.devicePixelRatio || 1));
    const [hg, hw, hh] = canvas("histogram");
    const bins = 40, top = Math.max(...S.lat) || 1, counts = new Array(bins).fill(0);
    for (const v of S.lat) counts[Math.min(bins - 1, Math.floor((v / top) * bins))]++;
    const cmax = Math.max(...counts) || 1;
    hg.fillStyle = "#58a6ff";
    counts.forEach((c, i) => { const bh = (c / cmax) * (hh - 4); hg.fillRect((i / bins) * hw + 1, hh - bh, hw / bins - 2, bh); });
    hg.fillStyle = "#8a96a3"; hg.font = `${11 * (window.devicePixelRatio || 1)}px sans-serif`;
    hg.fillText(`0 .. ${top.toFixed(0)} us`, 4, 12 * (window.devicePixelRatio || 1));
    const sorted = [...S.lat].sort((a, b) => a - b);
    if (!S.status || S.status.p99_us === undefined) $("p99").textContent = Math.round(sorted[Math.floor(0.99 * (sorted.length - 1))]) + " us";
  }

  // rows (oldest first, at most RASTER_ROWS) as columns of n cells, row j's value at height j from the bottom, its
  // brightness level(v) in [0, 1]: one pixel per cell in an ImageData, scaled up by drawImage, so a 192 x 200 map is one blit.
  // breaks: indices of the rows that come after a pause in the stream: an orange line before each, as the columns
  // are frames, not equal steps of time.
  const heats = {};
  function heatmap(id, rows, n, level, breaks) {
    const [g, w, h] = canvas(id);
    let c = heats[id];
    if (!c || c.width !== RASTER_ROWS || c.height !== n) {
      c = heats[id] = document.createElement("canvas"); c.width = RASTER_ROWS; c.height = n;
    }
    const hg = c.getContext("2d"), img = hg.createImageData(RASTER_ROWS, n), px = img.data;
    const off = RASTER_ROWS - rows.length;
    rows.forEach((r, i) => r.forEach((v, j) => {
      const a = level(v), k = 4 * ((n - 1 - j) * RASTER_ROWS + off + i);
      px[k] = 88 * a; px[k + 1] = 166 * a; px[k + 2] = 255 * a; px[k + 3] = 255;
    }));
    hg.putImageData(img, 0, 0);
    g.imageSmoothingEnabled = false;
    g.drawImage(c, 0, 0, w, h);
    if (breaks && breaks.length) {
      const cw = w / RASTER_ROWS, lw = Math.max(2, Math.round(window.devicePixelRatio || 1));
      g.fillStyle = "#ff9f1c";
      for (const i of breaks) g.fillRect(Math.round((off + i) * cw) - lw / 2, 0, lw, h);
    }
  }

  // Where the frames drawn paused: the rows that come more than five periods and 50 ms after the row before them
  // (times t in seconds: when the loop acted on each), and the time without frames in all (a device that went
  // silent, frames lost on the link, a loop that fell behind and drew only the newest of the frames it caught up on).
  function streamPauses(t) {
    const period = 1 / ((S.info && S.info.rate_hz) || 1), at = []; let silent = 0;
    for (let i = 1; i < t.length; i++) {
      const d = t[i] - t[i - 1];
      if (d > Math.max(5 * period, 0.05)) { at.push(i); silent += d - period; }
    }
    return { at, silent };
  }

  // the output rows of the steps where the model ran (the others are all null)
  function ranRows() { return S.out.filter((r) => r && r.some((v) => v !== null && isFinite(v))); }

  function softmax(r) {
    let m = -Infinity; for (const v of r) if (v !== null && v > m) m = v;
    const e = r.map((v) => (v === null || !isFinite(v) ? 0 : Math.exp(v - m)));
    const sum = e.reduce((a, b) => a + b, 0) || 1;
    return e.map((v) => v / sum);
  }

  function drawInput() {
    const rows = S.inp; if (!rows.length) return;
    const nch = rows[rows.length - 1].length;
    const fam = S.info && S.info.family;
    const neural = fam === "bci" || fam === "bci_handwriting" || (S.info && S.info.device && S.info.device.kind === "headstage");
    if (neural) {
      let hi = 0; for (const r of rows) for (const v of r) if (v > hi) hi = v;
      hi = hi || 1;
      const ps = streamPauses(S.inpT.slice(-rows.length));
      heatmap("input", rows, nch, (v) => (v === null || !(v > 0) ? 0 : Math.min(1, v / hi)), ps.at);
      $("input-legend").textContent = `${nch} channels x last ${rows.length} frames; brightest = ${hi} counts` +
        (ps.at.length ? `; orange: ${ps.at.length} pause${ps.at.length === 1 ? "" : "s"}, ` +
          `${ps.silent.toFixed(2)} s without frames (columns are frames, not time)` : "");
    } else {
      const [g, w, h] = canvas("input");
      const cols = []; for (let j = 0; j < Math.min(nch, 8); j++) cols.push(column(rows, j));
      let est = [], estWhat = "";
      const pred = stateGroups().find((x) => x.name === "predicted");
      if (pred) {  // the family's prediction of each measured value (an observer's C z_hat before its update)
        const st = S.inpSt.slice(-rows.length);
        for (const k of pred.offsets.slice(0, cols.length)) est.push(column(st, k));
        estWhat = `, and what the ${fam === "observer" ? "observer" : "family"} predicted for each before reading it (dashed, same colours)`;
      } else if (fam === "observer") {  // a recording without the family's state: the graph's output
        const est0 = S.inpOut.slice(-rows.length), no = (est0.find((r) => r) || []).length;
        for (let j = 0; j < Math.min(no, 4); j++) est.push(column(est0, j));
        estWhat = `, ${est.length} values of the correction N(r) computed from each (later colours)`;
      }
      const [lo, hi] = range(cols.concat(est));
      lines(g, w, h, cols, rows.length, lo, hi);
      if (pred) lines(g, w, h, est, rows.length, lo, hi, [6, 4]); else lines(g, w, h, est, rows.length, lo, hi, null, cols.length);
      $("input-legend").textContent = `${nch} measured value${nch === 1 ? "" : "s"}${nch > 8 ? " (first 8 shown)" : ""}` + estWhat + ` over the last ${rows.length} frames`;
    }
  }

  // A text decoder sends characters, not numbers: its panel shows what the model outputs instead, each run's
  // probability of every class (the softmax of its first data output: the CTC log-probabilities), blank included.
  function drawClassProbabilities() {
    const o = ((S.info && S.info.outputs) || [])[0];
    const ran = ranRows().slice(-RASTER_ROWS);
    if (!o || !ran.length) { canvas("command"); return; }
    heatmap("command", ran.map((r) => softmax(r.slice(o.offset, o.offset + o.size))), o.size, (p) => Math.min(1, p));
    $("command-legend").textContent = `decoder output: each class's probability per model run (${o.size} classes, ` +
      `output 0 at the bottom; brightest = 1), the last ${ran.length} runs, newest right`;
  }

  function drawCommand() {
    if (S.info && S.info.family === "bci_handwriting") { drawClassProbabilities(); return; }
    const [g, w, h] = canvas("command");
    const n = S.cmd.length; if (!n) return;
    S.flags.forEach((f, i) => { if (f & FLAG.SAFE) { g.fillStyle = "rgba(248,81,73,0.25)"; g.fillRect((i / Math.max(1, n - 1)) * w - 1, 0, Math.max(2, w / n + 1), h); } });
    const nc = Math.min(8, (S.cmd[n - 1] || []).length);
    const cols = []; for (let j = 0; j < nc; j++) cols.push(column(S.cmd, j));
    const [lo, hi] = range(cols);
    lines(g, w, h, cols, n, lo, hi);
  }

  // A graph with several data outputs (a click head beside a velocity): each output in a band of its own, on its
  // own scale, over the steps the model ran; the bands follow info.outputs (name, offset, size) top to bottom.
  function drawOutputs() {
    const outs = (S.info && S.info.outputs) || [];
    const box = $("outputs-box");
    if (outs.length < 2) { box.hidden = true; return; }
    box.hidden = false;
    const [g, w, h] = canvas("outputs");
    const ran = ranRows();
    const shown = outs.slice(0, 4), band = h / shown.length, names = [];
    shown.forEach((o, b) => {
      const cols = []; for (let j = 0; j < Math.min(o.size, 4); j++) cols.push(column(ran, o.offset + j));
      const [lo, hi] = range(cols);
      g.save(); g.translate(0, b * band);
      if (b) { g.strokeStyle = "#30363d"; g.beginPath(); g.moveTo(0, 0); g.lineTo(w, 0); g.stroke(); }
      lines(g, w, band, cols, ran.length, lo, hi);
      g.fillStyle = "#8a96a3"; g.font = `${11 * (window.devicePixelRatio || 1)}px sans-serif`;
      g.fillText(`${o.name}  ${lo.toPrecision(3)} .. ${hi.toPrecision(3)}`, 4, 12 * (window.devicePixelRatio || 1));
      g.restore();
      names.push(`${o.name} (${o.size} value${o.size === 1 ? "" : "s"}${o.size > 4 ? ", first 4 shown" : ""})`);
    });
    $("outputs-legend").textContent = `model outputs, one band each, top to bottom: ${names.join(", ")}` +
      (outs.length > shown.length ? `; ${outs.length - shown.length} more not shown` : "") +
      `; last ${ran.length} steps the model ran`;
  }

  // The family's state over the steps the model ran, a band per group on its own scale (an observer: the plant's
  // states, then its disturbances); the "predicted" group is drawn over the input instead.
  function drawState() {
    const groups = stateGroups().filter((x) => x.name !== "predicted");
    if (!groups.length) return;
    const [g, w, h] = canvas("family-state");
    const ran = S.st.filter((r) => r && r.some((v) => v !== null && isFinite(v)));
    const band = h / groups.length, dpr = window.devicePixelRatio || 1, names = [];
    groups.forEach((grp, b) => {
      const cols = grp.offsets.slice(0, 8).map((k) => column(ran, k));
      const [lo, hi] = range(cols);
      g.save(); g.translate(0, b * band);
      if (b) { g.strokeStyle = "#30363d"; g.beginPath(); g.moveTo(0, 0); g.lineTo(w, 0); g.stroke(); }
      lines(g, w, band, cols, ran.length, lo, hi);
      g.font = `${11 * dpr}px sans-serif`;
      let x = 4;
      g.fillStyle = "#8a96a3"; g.fillText(`${grp.name}  ${lo.toPrecision(3)} .. ${hi.toPrecision(3)}`, x, 12 * dpr);
      x += g.measureText(`${grp.name}  ${lo.toPrecision(3)} .. ${hi.toPrecision(3)}  `).width;
      grp.labels.slice(0, 8).forEach((l, k) => { g.fillStyle = COLORS[k % COLORS.length]; g.fillText(l, x, 12 * dpr); x += g.measureText(l + "  ").width; });
      g.restore();
      names.push(`${grp.name} (${grp.labels.length} value${grp.labels.length === 1 ? "" : "s"}${grp.labels.length > 8 ? ", first 8 shown" : ""})`);
    });
    const what = S.info && S.info.family === "observer" ? "the estimate after each step's update" : "the family's state after each model run";
    $("state-legend").textContent = `${what}, one band per group, top to bottom: ${names.join(", ")}; last ${ran.length} steps the model ran`;
  }

  function renderEvents() {
    const ol = $("events"); ol.innerHTML = "";
    for (const e of S.events.slice(-100).reverse()) {
      const li = document.createElement("li");
      li.className = e.event;
      const rest = Object.entries(e).filter(([k]) => !["event", "step", "type", "t_ns", "t_s"].includes(k)).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(" ");
      li.textContent = `step ${e.step ?? "-"}  ${e.event}  ${rest}`.slice(0, 300);
      ol.appendChild(li);
    }
  }

  let drawn = -1;
  function render() {
    $("step").textContent = Math.max(0, S.step);
    $("missed").textContent = S.counts.missed;
    $("lost").textContent = S.counts.lost;
    $("watchdog").textContent = S.counts.watchdog;
    $("reconnects").textContent = S.counts.reconnects;
    $("dropped").textContent = S.counts.dropped;
    // before the first WebSocket opens the page is "connecting"; after a drop, "reconnecting" (it retries every second)
    const st = S.ended ? "ended" : S.connected ? S.state : S.everConnected ? "reconnecting" : "connecting";
    $("state").textContent = st; $("state").dataset.state = st;
    $("typed").textContent = S.text; $("prompt").textContent = S.prompt ? "prompt: " + S.prompt : "";
    const version = S.updates + (S.recordingT || 0);
    if (version === drawn) return;  // nothing new: leave the canvases as they are
    drawn = version;
    try { drawTiming(); drawInput(); drawCommand(); drawOutputs(); drawState(); } catch (err) { console.error(err); }
  }

  setInterval(() => { $("ups").textContent = updatesThisSecond; S.ups = updatesThisSecond; updatesThisSecond = 0; }, 1000);
  setInterval(render, 100);

  function connect() {
    const token = new URLSearchParams(location.search).get("token");
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    const ws = new WebSocket(`${proto}//${location.host}/ws` + (token ? `?token=${encodeURIComponent(token)}` : ""));
    ws.onopen = () => { S.connected = true; S.everConnected = true; };
    ws.onmessage = (ev) => {
      let m; try { m = JSON.parse(ev.data); } catch { return; }
      if (m.type === "hello") onHello(m); else if (m.type === "steps") onSteps(m); else if (m.type === "event") onEvent(m);
      else if (m.type === "recording") onRecording(m);
    };
    ws.onclose = () => { S.connected = false; if (!S.ended) setTimeout(connect, 1000); };
  }
  connect();
})();
