// The studio's page: a tab per stage (the URL's #fragment), each in pages/. The API key, when the studio needs one,
// is asked once and traded for a session cookie (POST /api/login): EventSource, <iframe> and download links cannot
// send a header.
import {ApiError, get, post} from "./api.js";
import {$} from "./ui.js";
import * as data from "./pages/data.js";
import * as train from "./pages/train.js";
import * as map from "./pages/map.js";
import * as evaluate from "./pages/evaluate.js";
import * as chat from "./pages/chat.js";
import * as exporting from "./pages/export.js";

const PAGES = {data, train, map, evaluate, chat, export: exporting};

async function show() {
  const name = location.hash.slice(1) in PAGES ? location.hash.slice(1) : "data";
  for (const section of document.querySelectorAll(".page")) section.hidden = section.id !== `page-${name}`;
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.dataset.page === name);
  document.body.dataset.page = name;
  await PAGES[name].show();
  document.body.dataset.ready = name;
}

async function loggedIn() {
  try {
    return await get("/api/status");
  } catch (error) {
    if (!(error instanceof ApiError) || error.status !== 401) throw error;
  }
  const dialog = $("login");
  dialog.showModal();
  return new Promise(resolve => {
    $("login-form").addEventListener("submit", async event => {
      event.preventDefault();
      try {
        await post("/api/login", {key: $("login-key").value});
        $("login-key").value = "";
        dialog.close();
        resolve(await get("/api/status"));
      } catch (error) {
        $("login-error").textContent = error.message;
      }
    });
  });
}

async function start() {
  const status = await loggedIn();
  $("workdir").textContent = status.workdir;
  for (const page of Object.values(PAGES)) page.init();
  window.addEventListener("hashchange", show);
  await show();
}

start();
