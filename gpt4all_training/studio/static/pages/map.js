// Map and curate: `inference` and `build_map` of a run (a job), the map in the page (its own selection tools: search,
// a cluster, the lasso), `curate` from its selection, and training again on the curated folder.
import {get, runJob} from "../api.js";
import {$, busy, listing, optionValues, packagedOptions, setOptions, showCommand} from "../ui.js";

let runs = [];
let packaged = [];  // the packaged models: the base before training, mapped over the run's data
let shownMap = null;  // the inference folder whose map is shown

function modelsOf(name) {
  const run = runs.find(r => r.name === name);
  if (!run) return [];
  return [...(run.final ? [run.final] : []), ...run.checkpoints.map(step => `${run.output_dir}/step_${step}`),
          ...packaged];
}

function showMap(folder) {
  shownMap = folder;
  $("map-frame").src = `/files/${folder}/map.html`;
  $("curate-output").value = `data/${folder.split("/").pop()}-curated`;
}

// The map page keeps its selection in its #selection-json box: {"input": ..., "ids": [...]}, or empty.
function selection() {
  const box = $("map-frame").contentDocument?.getElementById("selection-json");
  const text = box ? box.value || box.textContent : "";
  return text ? JSON.parse(text).ids : null;
}

async function refresh() {
  const [listed, files] = await Promise.all([get("/api/runs"), listing()]);
  runs = listed.runs.filter(r => r.final || r.checkpoints.length);
  packaged = packagedOptions(files);
  setOptions($("map-run"), runs.map(r => r.name));
  setOptions($("map-model"), modelsOf($("map-run").value));
  setOptions($("map-existing"), files.maps, "(a map built before)");
}

export function init() {
  $("map-run").addEventListener("change", () => setOptions($("map-model"), modelsOf($("map-run").value)));
  $("map-existing").addEventListener("change", () => $("map-existing").value && showMap($("map-existing").value));
  $("map-build").addEventListener("click", event => busy("map", event.target, async () => {
    const result = await runJob("map", {...optionValues($("map-form")), run: $("map-run").value,
                                        model: $("map-model").value}, job => {
      showCommand("map", job.commands);
      $("map-log").textContent = job.log.join("\n");
    });
    $("map-log").textContent += `\n${result.points} points; map ${result.map}`;
    showMap(result.input);
  }));
  $("curate-button").addEventListener("click", event => busy("map", event.target, async () => {
    if (!shownMap) throw new Error("error: build or open a map first");
    const mode = document.querySelector("input[name=curate-mode]:checked").value;
    const ids = mode === "none" ? null : selection();
    if (mode !== "none" && ids === null) throw new Error("error: select points on the map first (search, a " +
                                                         "cluster row or the lasso), or ignore the selection");
    const values = optionValues($("curate-form"));
    const result = await runJob("curate", {...values, input: shownMap, output: values.output ?? "", ids,
                                           keep_selected: mode === "include"},
                                job => showCommand("map", job.commands));
    const dropped = Object.entries(result.dropped).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
    $("curate-result").textContent = `read ${result.read}, kept ${result.kept}, dropped ${dropped}: ` +
                                     `${result.output}`;
    $("curate-train").disabled = false;
    $("curate-train").dataset.dataset = result.dataset_path;
  }));
  // Training again: the config of the run the map was made from, on the curated folder, as a new run.
  $("curate-train").addEventListener("click", () => {
    const name = shownMap.split("/").pop();
    const run = runs.find(r => r.name === name);
    sessionStorage.setItem("studio-train", JSON.stringify({config: run?.config ?? null, name: `${name}-curated`,
                                                           dataset_path: $("curate-train").dataset.dataset}));
    location.hash = "#train";
  });
}

export async function show() {
  await refresh();
}
