// The admin's site tokens panel: one participant token per site, minted, listed and revoked
// through the same /v1/admin/tokens API as `fedtrain token`. A minted token is shown once,
// in the page only (the run keeps its sha256); it is never stored by the page.
"use strict";

const TOKENS_REFRESH_MS = 10000;

async function loadTokens() {
  const got = await api("v1/admin/tokens").catch(() => null);
  if (got) renderTokens(got.tokens);
}

function renderTokens(tokens) {
  const body = $("tokens").querySelector("tbody");
  body.replaceChildren(...tokens.map((t) => {
    const revoke = t.revoked ? null : el("button", { type: "button", class: "danger", text: "Revoke",
      dataset: { revoke: t.token_id }, onclick: () => revokeClicked(t) });
    return el("tr", { dataset: { token: t.token_id } },
      el("td", { text: t.name || "–" }),
      el("td", { class: "mono", text: t.token_id }),
      el("td", { text: t.source || "" }),
      el("td", {}, el("span", { class: "pill " + (t.revoked ? "evicted" : "active"), text: t.revoked ? "revoked" : "live" })),
      el("td", { text: t.participants.join(", ") || "–" }),
      el("td", {}, revoke));
  }));
  $("tokens-hint").textContent = `${tokens.filter((t) => !t.revoked).length} live`;
}

function setTokensResult(state, text) {
  $("tokens-result").dataset.state = state;
  $("tokens-result").textContent = text;
}

async function mintClicked(e) {
  e.preventDefault();
  const name = $("mint-name").value.trim();
  if (!name) return;
  $("minted").hidden = true;
  try {
    const r = await api("v1/admin/tokens", { method: "POST", body: { name } });
    $("minted-name").textContent = r.name;
    $("minted-token").textContent = r.token;
    $("minted").hidden = false;
    $("mint-name").value = "";
    setTokensResult("ok", "");
  } catch (err) {
    setTokensResult("error", "Not minted: " + err.message);
  }
  loadTokens();
}

async function revokeClicked(t) {
  const who = t.participants.length ? ` Its participants (${t.participants.join(", ")}) are evicted.` : "";
  if (!confirm(`Revoke token ${t.name || t.token_id}?${who}\n\nIt is refused from now on.`)) return;
  try {
    const r = await api("v1/admin/tokens/revoke", { method: "POST", body: { token_id: t.token_id } });
    setTokensResult("ok", `Revoked ${t.name || r.revoked}; evicted: ${r.evicted.join(", ") || "none"}.`);
  } catch (err) {
    setTokensResult("error", "Not revoked: " + err.message);
  }
  loadTokens();
}

// Called by app.js's signIn for the admin: the panel's first load, then a refresh now and then.
function startTokens() {
  $("minted").hidden = true;
  loadTokens();
  return setInterval(loadTokens, TOKENS_REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  $("mint-form").addEventListener("submit", mintClicked);
});
